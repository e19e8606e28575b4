"""
bench/profile_step.py on a CPU at a tiny size, with base_train's levers; bench/kernel_kinds.py's reading of a GPU trace.

What only a GPU run checks: that a CUDA trace's kernels and launches come as read_step reads them (here a trace of
that shape made by hand: the categories and the "correlation" of torch.profiler's chrome traces), and the figures.
"""

import gzip
import json
import os
import re
import sys

import pytest

from helpers import REPO_ROOT, one_line_error, run_script

sys.path.insert(0, os.path.join(REPO_ROOT, "bench"))  # bench/ is no package
from kernel_kinds import gpu_report, kernel_kind, kind_in_step, read_step, union_and_gaps  # noqa: E402

REGIONS = ("forward", "backward", "clipping", "AdamW", "Muon")

# Kernel names as CUDA profiles of PyTorch training steps show them (cuBLAS, cuBLASLt, FlashAttention 2 in SDPA,
# cuDNN's and the memory-efficient attention, ATen's own kernels, Inductor's triton kernels), with their kind
REAL_NAMES = [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x"
     "_cublas", "matmul"),
    ("nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_TNT", "matmul"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn", "matmul"),
    ("cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x1_tn_align8", "matmul"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, false>"
     "(cublasLt::cublasSplitKParams<float>, float const*, __nv_bfloat16 const*, __nv_bfloat16*)", "matmul"),
    ("triton_tem_fused_mm_3", "matmul"),
    ("flash_fwd_kernel", "attention"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t, "
     "Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, true, false, false, true, true, false, false>"
     "(pytorch_flash::Flash_fwd_params)", "attention"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, "
     "2, false, false, cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 8, cutlass::bfloat16_t> >, true, false, "
     "false, false, false, true, false, false>(pytorch_flash::Flash_bwd_params)", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, "
     "cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x128_4x1x1_kernel0_0", "attention"),
    ("triton_tem_fused_flex_attention_0", "attention"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
     "at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)", "attention"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
     "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)",
     "softcapped loss over the vocabulary"),
    ("void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>(float*, "
     "float*, float const*, long const*, float const*, bool, long, long, long, long)",
     "softcapped loss over the vocabulary"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::tanh_kernel_cuda(at::TensorIteratorBase&)::"
     "{lambda()#2}::operator()() const::{lambda()#2}::operator()() const::{lambda(float)#1}, "
     "at::detail::Array<char*, 2> >(int, at::native::tanh_kernel_cuda(at::TensorIteratorBase&)::{lambda()#2}::"
     "operator()() const::{lambda()#2}::operator()() const::{lambda(float)#1}, at::detail::Array<char*, 2>)",
     "softcapped loss over the vocabulary"),
    ("triton_red_fused__log_softmax__to_copy_div_tanh_0", "softcapped loss over the vocabulary"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<4u>, "
     "unsigned int, 2, 128, 1>(at::native::(anonymous namespace)::OpaqueType<4u>*, "
     "at::native::(anonymous namespace)::CatArrInputTensorMetadata<at::native::(anonymous namespace)::OpaqueType<4u>, "
     "unsigned int, 128, 1>, at::native::(anonymous namespace)::TensorSizeStride<unsigned int, 4u>, int, unsigned int)",
     "copies and casts"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::"
     "{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}, "
     "at::detail::Array<char*, 2>, TrivialOffsetCalculator<1, unsigned int>, TrivialOffsetCalculator<1, unsigned int>, "
     "at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1> >(int, ...)", "copies and casts"),
    ("triton_poi_fused_cat_0", "copies and casts"),
    ("triton_poi_fused__to_copy_1", "copies and casts"),
    ("Memcpy DtoH (Device -> Pageable)", "copies and casts"),
    ("Memset (Device)", "copies and casts"),
    ("triton_poi_fused_add_mul_0", "elementwise and reductions"),
    ("triton_poi_fused__to_copy_add_mul_2", "elementwise and reductions"),
    ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", "elementwise and reductions"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, at::detail::Array<char*, 1> >"
     "(int, at::native::FillFunctor<float>, at::detail::Array<char*, 1>)", "elementwise and reductions"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::NormTwoOps<float, float, float>, "
     "unsigned int, float, 4> >(at::native::ReduceOp<float, at::native::NormTwoOps<float, float, float>, unsigned int, "
     "float, 4>)", "elementwise and reductions"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, (ADAM_MODE)1, false>, "
     "float*, double, double, double, double, double, bool, float*, float*>(...)", "elementwise and reductions"),
    ("some_kernel_of_a_library_nobody_named", "other"),
]


@pytest.mark.parametrize("name, kind", REAL_NAMES, ids=[name[:48] for name, _ in REAL_NAMES])
def test_kernel_kind_of_real_kernel_names(name, kind):
    assert kernel_kind(name) == kind


def test_the_optimizers_regions_claim_their_kernels():
    gemm = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"
    assert kind_in_step(gemm, "forward") == "matmul"
    assert kind_in_step(gemm, "Muon") == "Muon: Newton-Schulz matmuls"
    assert kind_in_step("triton_poi_fused_add_mul_0", "Muon") == "Muon: the rest"
    assert kind_in_step("triton_poi_fused_add_mul_0", "AdamW") == "AdamW: the rest"
    assert kind_in_step(gemm, "clipping") == "clipping (the gradients' norm)"
    assert kind_in_step("Memcpy DtoH (Device -> Pageable)", "") == "copies and casts"


def test_union_and_gaps():
    # [0, 10]: (1, 3) and (2, 5) overlap into (1, 5); (7, 8); (9, 12) cut at 10; (-3, -1) outside
    busy, gaps = union_and_gaps([(9, 12), (1, 3), (7, 8), (2, 5), (-3, -1)], 0, 10)
    assert busy == 4 + 1 + 1
    assert gaps == [1, 2, 1]  # 0-1, 5-7, 8-9; nothing after 10
    assert union_and_gaps([], 2, 5) == (0.0, [3])
    busy, gaps = union_and_gaps([(0, 6), (1, 2), (7, 9)], 0, 10)  # one inside another; a gap at the end
    assert busy == 8 and gaps == [1, 1]


def annotation(name, ts, dur, cat="user_annotation"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur, "args": {}}


def gpu_shaped_trace():
    """A step's chrome trace as torch.profiler writes one on a GPU, made by hand (microseconds)."""
    def launch(ts, correlation, cat="cuda_runtime", name="cudaLaunchKernel"):
        return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": 3,
                "args": {"External id": 9, "cbid": 211, "correlation": correlation}}

    def kernel(name, ts, dur, correlation, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur,
                "args": {"External id": 9, "device": 0, "stream": 7, "correlation": correlation}}

    return {"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "python"}},
        launch(5, 1), kernel("before_the_step", 6, 2, 1),  # an earlier step's: left out
        annotation("step", 100, 900),
        annotation("forward", 110, 100), annotation("forward", 400, 100), annotation("Muon", 700, 100),
        annotation("forward", 120, 60, cat="gpu_user_annotation"),  # the GPU's copy of a region: not a CPU region
        launch(115, 2), kernel("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn", 130, 40, 2),
        launch(410, 3, cat="cuda_driver", name="cuLaunchKernel"), kernel("triton_poi_fused_add_0", 600, 50, 3),
        launch(710, 4), kernel("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_nn", 720, 10, 4),
        launch(900, 5, name="cudaMemcpyAsync"), kernel("Memcpy DtoH (Device -> Pageable)", 950, 60, 5, "gpu_memcpy"),
        kernel("no_launch_seen", 302, 5, 99),
        kernel("no_launch_seen_in_a_gpu_region", 170, 5, 98),
    ]}


def test_read_step_ties_each_kernel_to_the_region_it_was_launched_from():
    trace = gpu_shaped_trace()
    (start, end), wall, kernels = read_step(trace, REGIONS)
    assert (start, end) == (100, 1000)
    assert wall == {"forward": 200, "backward": 0, "clipping": 0, "AdamW": 0, "Muon": 100}
    assert sorted(kernels, key=lambda k: k[1]) == [
        ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn", 130, 170, "forward"),
        ("no_launch_seen_in_a_gpu_region", 170, 175, "forward"),
        ("no_launch_seen", 302, 307, ""),
        ("triton_poi_fused_add_0", 600, 650, "forward"),
        ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_nn", 720, 730, "Muon"),
        ("Memcpy DtoH (Device -> Pageable)", 950, 1000, ""),  # cut at the step's end
    ]
    trace["traceEvents"].append(annotation("step", 2000, 10))
    with pytest.raises(ValueError, match="2 record_function regions named 'step'"):
        read_step(trace, REGIONS)


def test_gpu_report_of_a_step():
    lines = gpu_report(gpu_shaped_trace(), REGIONS, micro_steps=2, top_kernels=2)
    text = "\n".join(lines)
    busy = 40 + 5 + 5 + 50 + 10 + 50  # the kernels' union in the step (100 to 1000): none overlap
    assert lines[0] == ("the profiled step took 1 ms: the GPU busy 0 ms (18%), idle 0.7 ms (82%) in 5 gaps (5 of 10 "
                        "us or more: 0.7 ms; the longest 0.29 ms); 6 kernels launched (3 per micro-step, the "
                        "optimizers' included), median 25.0 us"), text
    assert busy == 160 and 900 - busy == 740 and 600 - 307 == 293  # the idle time; the longest gap
    assert "  forward: CPU 0 ms, GPU 0.1 ms  elementwise and reductions 53%, matmul 42%, other 5%" in lines, text
    assert "  Muon: CPU 0 ms, GPU 0.0 ms  Muon: Newton-Schulz matmuls 100%" in lines, text
    assert "  outside the regions: GPU 0.1 ms  copies and casts 91%, other 9%" in lines, text
    shares = next(line for line in lines if "share of the profiled step's wall time" in line)
    assert f"GPU idle {100 * 740 / 900:.1f}%" in shares and f"matmul {100 * 40 / 900:.1f}%" in shares, shares
    percents = [float(p) for p in re.findall(r" (\d+\.\d)%", shares)]
    assert len(percents) == 6 and abs(sum(percents) - 100) <= 0.05 * len(percents), shares
    assert "overlapped" not in text
    assert lines[-3] == "  top 2 kernels by GPU time (ms, share of the step, calls, kind, name):"
    assert sorted(line.split(None, 3)[3] for line in lines[-2:]) == [
        "copies and casts  Memcpy DtoH (Device -> Pageable)",
        "elementwise and reductions  triton_poi_fused_add_0"], text
    assert all(line.split()[:3] == ["0.05", "5.6%", "1"] for line in lines[-2:]), text  # 50 us of 900, once each


@pytest.mark.slow
def test_profile_step_on_a_cpu_with_base_trains_levers(tmp_path):
    path = tmp_path / "trace.json.gz"
    result = run_script("bench/profile_step.py", "--device_type=cpu", "--depth=2", "--max_seq_len=64",
                        "--vocab_size=512", "--device_batch_size=2", "--total_batch_size=256", "--attention=eager",
                        "--window_pattern=SSL", "--fp8=True", "--warmup=1", "--repeats=2", f"--trace={path}",
                        timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "model: depth 2, attention eager, windows SSL, fp8 True, torch.compile False" in out, out
    assert re.search(r"2 micro-step\(s\), vocab 512: step \d+ ms \(median of 2: \d+, \d+\), [\d,]+ tok/s, "
                     r"MFU \d+\.\d% of [\d.e+]+ FLOP/s", out), out
    walls = {name: float(ms) for name, ms in re.findall(r"^  (forward|backward|clipping|AdamW|Muon): (\d+) ms", out,
                                                        re.M)}
    assert set(walls) == set(REGIONS), out
    shares = re.search(r"by kind of op \(self time\): (.*)$", out, re.M).group(1)
    percents = [int(p) for p in re.findall(r" (\d+)%", shares)]
    assert "matmul" in shares and len(percents) >= 3, shares
    assert abs(sum(percents) - 100) <= len(percents) / 2, shares  # each rounded to a whole percent
    # the trace it wrote, read as a GPU's is read: the step and its regions, and on a CPU no GPU work
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    (start, end), wall, kernels = read_step(trace, REGIONS)
    assert kernels == []
    assert all(wall[name] > 0 for name in REGIONS), wall
    assert sum(wall.values()) <= end - start
    shares = next(line for line in gpu_report(trace, REGIONS, micro_steps=2) if "share of" in line)
    assert shares == "  share of the profiled step's wall time: GPU idle 100.0%", shares


def test_flex_attention_on_a_cpu_is_refused_in_one_line():
    result = run_script("bench/profile_step.py", "--device_type=cpu", "--attention=flex", timeout=300)
    one_line_error(result, "--attention=flex trains on CUDA only")


@pytest.mark.slow
def test_profile_step_compiled_as_on_a_gpu():
    # the GPU's default (base_train --compile=auto compiles on CUDA), with fp8 and windows, on the CPU
    result = run_script("bench/profile_step.py", "--device_type=cpu", "--depth=2", "--max_seq_len=64",
                        "--vocab_size=512", "--device_batch_size=2", "--total_batch_size=256", "--compile=true",
                        "--fp8=True", "--window_pattern=SSSL", "--warmup=1", "--repeats=2", timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "model: depth 2, attention auto, windows SSSL, fp8 True, torch.compile True" in out, out
    assert set(re.findall(r"^  (forward|backward|clipping|AdamW|Muon): \d+ ms", out, re.M)) == set(REGIONS), out
    assert re.search(r"^  compiled: \d+ ms \(\d+% of the regions\) outside aten ops", out, re.M), out
