"""
The run report: each stage appends a section of figures under $NANOCHAT_BASE_DIR/report/ and
`python -m nanochat.report generate` assembles them into report.md.
(The header, generate and plots arrive with the pretraining stage; sections can be logged now.)
"""

import datetime
import os

from nanochat.common import get_base_dir


def _slug(section):
    return "".join(c if c.isalnum() else "-" for c in section.lower()).strip("-")


class Report:
    def __init__(self, report_dir):
        self.report_dir = report_dir
        os.makedirs(report_dir, exist_ok=True)

    def log(self, section, data):
        """Write one section: `data` is a list of dicts (key -> value) or strings, written in order."""
        path = os.path.join(self.report_dir, f"{_slug(section)}.md")
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(f"## {section}\n")
            f.write(f"timestamp: {datetime.datetime.now():%Y-%m-%d %H:%M:%S}\n\n")
            for item in data:
                if isinstance(item, str):
                    f.write(item + "\n")
                else:
                    for k, v in item.items():
                        v = f"{v:.4f}" if isinstance(v, float) else v
                        f.write(f"- {k}: {v}\n")
            f.write("\n")
        os.replace(tmp, path)
        return path


class DummyReport:
    def log(self, *args, **kwargs):
        pass


def get_report():
    """The report on rank 0, a no-op elsewhere (only one process writes the report)."""
    if int(os.environ.get("RANK", 0)) == 0:
        return Report(os.path.join(get_base_dir(), "report"))
    return DummyReport()
