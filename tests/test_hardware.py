"""
The compute dtype (nanochat/hardware.py): decided by what the device does. decide_compute_dtype takes every input
(the override, the CPU's flags, the probe), so both answers are tested on any machine; the machine's own answer,
the start-up line, and the probes behind it and behind decoding (nanochat/probes.py), kept per machine, too.
"""

import json
import threading

import pytest
import torch

from nanochat.cpu_kernels import onednn_off
from nanochat.hardware import (autocast_context, bf16_flags_in, compile_model, compute_dtype, compute_dtype_line,
                               cpu_bf16_flags, decide_compute_dtype, get_peak_flops)
from nanochat.output import UserError
from nanochat.probes import NATIVE_GEMV_MAX_ROWS, NATIVE_GEMV_MIN_SPEEDUP, bf16_probe, native_bf16_gemv

# /proc/cpuinfo lines of real CPUs (shortened): an Intel Xeon of the Sapphire Rapids generation, an AMD Zen 4, an
# AWS Graviton3, and an AMD EPYC VM that hides AVX-512 (this repository's 2-core VM)
SAPPHIRE_RAPIDS = "flags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8\n"
ZEN4 = "flags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni\n"
GRAVITON3 = "Features\t: fp asimd sve sve2 bf16 i8mm\n"
NO_BF16_VM = "model name\t: AMD EPYC\nflags\t\t: fpu sse avx avx2 fma f16c vaes\n"


def never(*_):
    raise AssertionError("the probe must not run here")


def test_cpu_flags_are_read_from_cpuinfo():
    assert bf16_flags_in(SAPPHIRE_RAPIDS) == ("avx512_bf16", "amx_bf16")
    assert bf16_flags_in(ZEN4) == ("avx512_bf16",)
    assert bf16_flags_in(GRAVITON3) == ("bf16",)
    assert bf16_flags_in(NO_BF16_VM) == ()
    assert bf16_flags_in("model name\t: bf16 in a name is not a flag\n") == ()


def test_a_cpu_without_native_bf16_computes_in_fp32_without_probing():
    dtype, why = decide_compute_dtype("cpu", "", (), never)
    assert dtype == torch.float32 and "no native bf16" in why


def test_a_cpu_with_native_bf16_computes_in_bf16_when_the_probe_confirms():
    dtype, why = decide_compute_dtype("cpu", "", ("amx_bf16",), lambda: (850e9, 115e9))
    assert dtype == torch.bfloat16
    assert "amx_bf16" in why and "7.4x" in why


def test_flags_without_a_faster_bf16_matmul_stay_fp32():
    # e.g. a torch build whose kernels do not use the instructions: the flag alone decides nothing
    dtype, why = decide_compute_dtype("cpu", "", ("avx512_bf16",), lambda: (120e9, 100e9))
    assert dtype == torch.float32 and "1.2x" in why


def test_the_override_wins_both_ways():
    assert decide_compute_dtype("cpu", "float32", ("amx_bf16",), never) == (torch.float32, "NANOCHAT_DTYPE=float32")
    assert decide_compute_dtype("cpu", "bfloat16", (), never) == (torch.bfloat16, "NANOCHAT_DTYPE=bfloat16")
    assert decide_compute_dtype("cuda", "float32", (), never)[0] == torch.float32
    with pytest.raises(UserError, match="use bfloat16 or float32"):
        decide_compute_dtype("cpu", "fp16", (), never)


def test_cuda_and_mps_ignore_cpu_flags(monkeypatch):
    # CUDA: bf16 from compute capability 8.0 (A100, H100); a V100 (7.0) or T4 (7.5) only emulates it, although
    # torch.cuda.is_bf16_supported() says yes there. No CPU probe either way. (The GPU's answer is given here.)
    answers = (((7, 0), torch.float32), ((7, 5), torch.float32), ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16))
    for capability, dtype in answers:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert decide_compute_dtype("cuda", "", ("amx_bf16",), never)[0] == dtype
    assert decide_compute_dtype("mps", "", ("bf16",), never)[0] == torch.float32


def test_this_machine_and_the_override_in_the_environment(monkeypatch, isolated_env):
    monkeypatch.delenv("NANOCHAT_DTYPE", raising=False)
    dtype, why = compute_dtype("cpu")
    if not cpu_bf16_flags():
        assert dtype == torch.float32 and not (isolated_env / "compute_dtype.json").exists()  # nothing probed
    name = str(dtype).removeprefix("torch.")
    assert compute_dtype_line("cpu") == f"Compute dtype: {name} ({why}; weights and optimizer state stay fp32)"
    monkeypatch.setenv("NANOCHAT_DTYPE", "bfloat16")
    dtype, context = autocast_context("cpu")
    assert dtype == torch.bfloat16
    with context:
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    monkeypatch.setenv("NANOCHAT_DTYPE", "float32")
    assert autocast_context("cpu")[0] == torch.float32


def test_the_probe_is_measured_once_per_machine(isolated_env):
    first = bf16_probe(n=64)  # small: this test must be quick where bf16 is emulated
    assert all(flops > 0 for flops in first)
    cache = json.loads((isolated_env / "compute_dtype.json").read_text())
    (key, entry), = cache.items()
    assert f"{torch.get_num_threads()} threads" in key and torch.__version__ in key
    assert bf16_probe(n=64) == first
    entry["bfloat16"] = 1.0
    (isolated_env / "compute_dtype.json").write_text(json.dumps({key: entry}))
    assert bf16_probe() == (1.0, entry["float32"])


def test_the_kernels_for_one_row_decoding_are_measured_once_per_machine(isolated_env):
    # more rows than NATIVE_GEMV_MAX_ROWS: oneDNN without a measurement
    assert native_bf16_gemv(NATIVE_GEMV_MAX_ROWS + 1) is False and not (isolated_env / "decode_matmuls.json").exists()
    answer = native_bf16_gemv(1)
    cache = json.loads((isolated_env / "decode_matmuls.json").read_text())
    (key, speedups), = cache.items()
    assert f"{torch.get_num_threads()} threads" in key and torch.__version__ in key
    assert set(speedups) == {str(rows) for rows in range(1, NATIVE_GEMV_MAX_ROWS + 1)} and min(speedups.values()) > 0
    assert answer == (speedups["1"] >= NATIVE_GEMV_MIN_SPEEDUP)
    for kept in (NATIVE_GEMV_MIN_SPEEDUP / 2, NATIVE_GEMV_MIN_SPEEDUP * 2):  # from then on the kept entry decides
        (isolated_env / "decode_matmuls.json").write_text(json.dumps({key: {"1": kept, "2": kept}}))
        assert native_bf16_gemv(1) is native_bf16_gemv(2) is (kept >= NATIVE_GEMV_MIN_SPEEDUP)


def test_onednn_off_restores_the_setting_when_the_step_fails():
    assert torch.backends.mkldnn.enabled
    with pytest.raises(KeyboardInterrupt):
        with onednn_off():
            assert not torch.backends.mkldnn.enabled
            raise KeyboardInterrupt  # a stop inside a decoding step
    assert torch.backends.mkldnn.enabled


def test_onednn_off_in_two_threads_at_once_restores_it_when_the_last_leaves():
    # a server's worker thread decoding while another thread decodes too: A in, B in, A out, B out (each saving and
    # restoring on its own, B would restore "off" for good)
    a_in = threading.Event()
    b_in = threading.Event()
    a_out = threading.Event()
    inside = []

    def a():
        with onednn_off():
            a_in.set()
            b_in.wait(10)
        inside.append(torch.backends.mkldnn.enabled)  # B is still inside: still off
        a_out.set()

    def b():
        a_in.wait(10)
        with onednn_off():
            b_in.set()
            a_out.wait(10)

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert inside == [False] and torch.backends.mkldnn.enabled


def test_measuring_the_hardware_leaves_the_global_rng_alone(isolated_env, monkeypatch):
    # The global RNG decides a run's initial weights: a measurement that drew from it (the probe, in the one run
    # that measures it; the peak FLOP/s, in every run) would make the run's numbers depend on it
    monkeypatch.delenv("NANOCHAT_PEAK_FLOPS", raising=False)
    before = torch.get_rng_state()
    bf16_probe(n=64)
    get_peak_flops("cpu", torch.float32)
    native_bf16_gemv(1)
    assert torch.equal(torch.get_rng_state(), before)


def test_the_peak_flops_is_the_override_or_the_best_measurement_ever(isolated_env, monkeypatch):
    # every other test runs with NANOCHAT_PEAK_FLOPS set (conftest.pytest_configure): measuring costs ~4 s of CPU a run
    import nanochat.hardware as hardware
    monkeypatch.setenv("NANOCHAT_PEAK_FLOPS", "2.5e11")
    assert get_peak_flops("cpu", torch.float32) == (2.5e11, "NANOCHAT_PEAK_FLOPS")
    monkeypatch.setenv("NANOCHAT_PEAK_FLOPS", "fast")
    with pytest.raises(UserError, match="need a positive number"):
        get_peak_flops("cpu", torch.float32)
    monkeypatch.delenv("NANOCHAT_PEAK_FLOPS")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # a lower reading (a busy moment) never replaces the best one kept in <base_dir>/peak_flops.json
        for reading, kept in ((2e10, 2e10), (1e10, 2e10), (3e10, 3e10)):
            monkeypatch.setattr(hardware, "measure_matmul_flops", lambda device, dtype, n, repeats: reading)
            flops, source = get_peak_flops("cpu", torch.float32)
            assert flops == kept and f"this run {reading:.3e}" in source
    finally:
        torch.set_num_threads(threads)
    assert list(json.loads((isolated_env / "peak_flops.json").read_text()).values()) == [3e10]


def test_compile_auto_is_on_for_cuda_only():
    model = torch.nn.Linear(2, 2)
    assert compile_model(model, "auto", "cpu") == (model, False)
    assert compile_model(model, "false", "cuda") == (model, False)
