"""The Python API is quiet too: ompmoe's own model loads and saves print no other library's bars, lines or warnings,
and leave nothing switched off for the caller's code. What ompmoe does not run (the caller's own imports of
transformers' models, the caller's Trainer) is silenced by the lines docs/usage.md gives ("Messages in Python").

Each test runs what a user runs in a fresh process (the noise comes from first imports) and checks the whole stderr.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
USAGE = ROOT / "docs" / "usage.md"
MARKER = "--- the user's own calls ---"


def documented_silencing_lines() -> str:
    """The python block of docs/usage.md's "Messages in Python" section."""
    section = USAGE.read_text(encoding="utf-8").split("### Messages in Python", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"<!-- runs in: tests/test_quiet_python.py -->\n```python\n(.*?)```", section, re.DOTALL)
    return block


def run_python(code: str, cwd: Path) -> str:
    """``python -c code`` in a fresh process as a user runs it (stderr a pipe, no ompmoe command); its stderr."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    for name in ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE", "TRANSFORMERS_VERBOSITY"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stderr


STATE = """
def state():
    import logging, warnings
    from transformers.utils import logging as hf_logging
    ours = [f for f in warnings.filters if f[1] is not None and "is_gradient_checkpointing" in f[1].pattern]
    return (getattr(hf_logging, "_tqdm_hook", None), hf_logging.is_progress_bar_enabled(), ours,
            [list(logging.getLogger(name).filters) for name in ("torchao", "torch.utils._pytree")])
"""


def test_loads_and_saves_print_nothing_and_leave_the_callers_bars_on(tmp_path):
    code = STATE + f"""
import sys
import ompmoe
from ompmoe.data import resolve_shipped

before = state()
path = resolve_shipped("shipped:tiny-moe")
model = ompmoe.load_pruned(path)                       # the first import of transformers' modeling code (torchao)
ompmoe.save_pruned(model, "copy")
ompmoe.load_pruned("copy")
module = ompmoe.FinetuneModule("copy", lora_rank=4)    # peft's get_peft_model
module.configure_model()
module.save_pruned("merged")
assert state() == before, (state(), before)
print({MARKER!r}, file=sys.stderr)
from transformers import AutoModelForCausalLM

AutoModelForCausalLM.from_pretrained(path)             # the caller's own load keeps its bar
"""
    stderr = run_python(code, tmp_path)
    ours, theirs = stderr.split(MARKER + "\n")
    assert ours == "", ours
    assert "Loading weights" in theirs, theirs


@pytest.mark.slow
def test_finetuning_and_fabric_in_python_print_only_ompmoe_lines_after_the_documented_ones(tmp_path):
    """The docs' Python fine-tuning flow and a Fabric calibration, after docs/usage.md's lines for the noise of the
    user's own Trainer: stderr holds ompmoe's progress lines only (stderr is not a terminal here)."""
    code = documented_silencing_lines() + """
import lightning.pytorch as pl
import ompmoe
from lightning.fabric import Fabric
from ompmoe.lightning.models import load_model

module = ompmoe.FinetuneModule("shipped:tiny-moe", teacher="shipped:tiny-moe", distill_weight=0.5, lora_rank=4,
                               learning_rate=1e-3, keep_best=False, save_dir="finetuned")  # no restore warning
data = ompmoe.FinetuneDataModule(tokenizer="shipped:tiny-moe", seq_len=32, num_blocks=4, batch_size=2,
                                 val_sources=["shipped:prose"], val_blocks=1)
trainer = pl.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False)
trainer.fit(module, data)
ompmoe.load_pruned("finetuned")

fabric = Fabric(accelerator="cpu", devices=1)
fabric.launch()
model = fabric.setup(load_model("finetuned").eval())
calibration = ompmoe.FabricCalibration(fabric, model, ompmoe.PruningStrategy(ratio=0.5), output_dir="run", plots=False)
calibration.run(fabric.setup_dataloaders(data.train_dataloader()))
calibration.finish()
"""
    stderr = run_python(code, tmp_path)
    progress = re.compile(r"ompmoe: fine-tuning step \d+/2, loss \d+\.\d{4}, \S+ elapsed(, about \S+ left)?")
    lines = stderr.splitlines()
    assert lines and all(progress.fullmatch(line) for line in lines), stderr
    assert (tmp_path / "run" / "model" / "config.json").is_file()


def test_the_documented_lines_silence_the_import_noise_ompmoe_cannot_stop(tmp_path):
    """A user's own first import of transformers' modeling code prints torchao's lines (where torchao is installed);
    docs/usage.md's lines drop them."""
    pytest.importorskip("torchao")
    loud = run_python("import transformers.modeling_utils", tmp_path)
    if not loud:
        pytest.skip("torchao prints nothing on import here (its kernels load)")
    assert "torchao" in loud or "Enum subclass" in loud, loud
    assert run_python(documented_silencing_lines() + "import transformers.modeling_utils", tmp_path) == ""


def test_usage_page_is_named_here():
    """docs/usage.md's block of silencing lines runs in this file (tests/test_docs.py checks the page is named)."""
    assert "docs/usage.md" in Path(__file__).read_text(encoding="utf-8")
    assert "torchao" in documented_silencing_lines()
