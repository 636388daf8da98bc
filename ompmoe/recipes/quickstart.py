"""The offline main job: calibrate, plan, prune, save and reload a small MoE on shipped text.

``ompmoe-demo`` (writing ``outputs/demo``) runs everything a real job runs on the trained
``shipped:tiny-moe`` model (calibrated on the shipped corpus' calibration split, perplexity on its
held-out split before and after pruning), in seconds and without a network;
``--model tiny --model_type gpt_oss`` does the same on a tiny random model of any supported
architecture (byte tokens of the shipped text; its perplexity means nothing).
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from .._quiet import passive_omp_threads, quiet_calls, quiet_third_party

# The command (its script imports this module first):
passive_omp_threads(__name__ == "__main__" or Path(sys.argv[0]).name.startswith("ompmoe-demo"))

import torch  # noqa: E402

from ..cli_args import bare_flags, fail, user_errors  # noqa: E402
from ..data import byte_tokens, corpus_token_stream, resolve_shipped, shipped_text, token_blocks  # noqa: E402
from ..engine.export.checkpoint import MissingTokenizerWarning  # noqa: E402
from ..engine.export.load import load_pruned  # noqa: E402
from ..engine.planning.strategy import PruningStrategy  # noqa: E402
from ..engine.ranks import LocalContext  # noqa: E402
from ..engine.run import PruningRun, RunOptions  # noqa: E402
from ..engine.tiny import tiny_model  # noqa: E402

SHIPPED_MODEL = "shipped:tiny-moe"
DATA_DIR = Path(__file__).parents[1] / "data"
"""Everything the demo reads: the shipped models and text."""
RANDOM_MODEL = "tiny"


def demo_model_and_data(model: str, model_type: str, seq_len: int,
                        num_blocks: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, str, str]:
    """``(model, calibration blocks, held-out blocks, model id, source)`` of the demo.

    The shipped model gets half its blocks from each domain's calibration split and is scored on
    the held-out splits; the random tiny model gets byte blocks of the shipped text.
    """
    if model == RANDOM_MODEL:
        blocks = token_blocks(byte_tokens(shipped_text()), seq_len, num_blocks + 2)
        with quiet_calls():  # its first build imports transformers' modeling code (torchao's lines)
            network = tiny_model(model_type)
        return (network, blocks[:num_blocks], blocks[num_blocks:], f"ompmoe.engine.tiny:{model_type}",
                "shipped:python-docs")
    if model != SHIPPED_MODEL:
        raise ValueError(f"model must be {SHIPPED_MODEL!r} (the trained shipped model) or {RANDOM_MODEL!r} (a random "
                         f"tiny model of model_type); got {model!r}. For other checkpoints use `ompmoe fit`.")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_shipped(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    with quiet_calls():  # no "Loading weights" bar nor torchao's import lines
        network = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # stored in bf16 for size
    per_domain = [(num_blocks + 1) // 2, num_blocks // 2]
    calibration = torch.cat([
        token_blocks(corpus_token_stream(tokenizer, domain, "calibration", seq_len * count), seq_len, count)
        for domain, count in zip(("prose", "code"), per_domain) if count
    ])
    held_out = torch.cat([token_blocks(corpus_token_stream(tokenizer, domain, "heldout", seq_len), seq_len, 1)
                          for domain in ("prose", "code")])
    return network, calibration, held_out, model, "shipped:prose,code calibration splits"


class CountedBatches:
    """The demo's calibration batches, counting those that went through the model (for the Ctrl-C line)."""

    def __init__(self, batches: Iterable[Any]) -> None:
        self.batches, self.done = list(batches), 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.batches:
            yield batch
            self.done += 1  # the loop asked for the next batch: this one went through the model


def prune_tiny_model(
    output_dir: str = "outputs/demo",
    model: str = SHIPPED_MODEL,
    model_type: str = "qwen3_moe",
    ratio: float = 0.5,
    allocation: str = "waterfill",
    risk_weight: float = 3.0,
    min_kept_fraction: float = 0.375,
    max_kept_fraction: float = 0.875,
    seq_len: int = 256,
    num_blocks: int = 16,
    batch_size: int = 4,
    overwrite: bool = False,
) -> dict[str, float]:
    """Prune a tiny ``model_type`` MoE calibrated on the shipped text with :class:`ompmoe.PruningRun` (the paper's
    ``omp``); write stats, plan and model, and check that the saved model reloads to the same logits.

    Args:
        output_dir: Directory for ``stats.safetensors``, ``plan.json`` and ``model/``.
        model: ``shipped:tiny-moe`` (the trained shipped Qwen3-MoE) or ``tiny`` (a random tiny model of
            ``model_type``).
        model_type: Architecture of the random tiny model (see ``ompmoe.supported_model_types()``); only with
            ``model=tiny``.
        ratio: Fraction of routed experts removed over all MoE layers (0.5 removes half).
        allocation: ``uniform``, ``waterfill`` or ``optimal``.
        risk_weight: Lambda of the routing-risk term of the allocation cost.
        min_kept_fraction: Fewest experts a layer may keep, as a fraction of its experts.
        max_kept_fraction: Most experts a layer may keep, as a fraction of its experts.
        seq_len: Tokens per calibration block.
        num_blocks: Number of calibration blocks.
        batch_size: Blocks per forward pass.
        overwrite: Replace an existing ``output_dir``.
    """
    strategy = PruningStrategy(ratio=ratio, allocation=allocation, risk_weight=risk_weight,
                               min_kept_fraction=min_kept_fraction, max_kept_fraction=max_kept_fraction)
    run = PruningRun(RunOptions(strategy=strategy, output_dir=output_dir, overwrite=overwrite, plots=False,
                                evaluate_on=["held-out"]), owner="ompmoe-demo")
    context = LocalContext()
    batches = CountedBatches(())
    try:  # Ctrl-C before the run wrote its output (atomically, at the end of finish): one line, then the interrupt
        run.check_output(context, [str(DATA_DIR)])  # the shipped model and text: never replaced
        model_name = model
        model, blocks, held_out, model_id, source = demo_model_and_data(model_name, model_type, seq_len, num_blocks)
        start = time.perf_counter()
        data = SimpleNamespace(heldout_blocks=lambda name, num_blocks: held_out)  # where evaluate_on reads them
        run.start(model, context, model_id=model_id, sources=[source], data=data)
        batches = CountedBatches(blocks.split(batch_size))
        run.collect(batches)
        with warnings.catch_warnings():
            if model_name == RANDOM_MODEL:  # byte tokens: there is no tokenizer to save, and no flag could add one
                warnings.simplefilter("ignore", MissingTokenizerWarning)
                print("ompmoe-demo: the random tiny model reads UTF-8 bytes as tokens, so model/ has no tokenizer "
                      "files")
            plan = run.finish(context)
    except KeyboardInterrupt:
        total = len(batches) or -(-num_blocks // max(batch_size, 1))  # before the blocks are cut: their number
        print(run.interrupted_line(batches.done, total), file=sys.stderr)
        raise
    probe = blocks[:2, :64]
    try:
        with torch.no_grad():
            # Saved in the source checkpoint's dtype (bf16 for the shipped model, lossless: its weights are bf16
            # values); reloaded in the dtype the in-memory model computed in, the logits must be the same bits.
            reloaded = load_pruned(Path(output_dir) / "model", dtype=next(model.parameters()).dtype)
            if not torch.equal(reloaded(probe).logits, model(probe).logits):
                raise RuntimeError(f"The pruned model saved in {output_dir}/model does not reproduce the in-memory "
                                   "logits.")
    except KeyboardInterrupt:  # the output is written and whole; only its check did not run
        print(f"ompmoe: interrupted after writing {output_dir}, before checking that its model reloads to the same "
              "logits", file=sys.stderr)
        raise
    elapsed = time.perf_counter() - start
    before, after = run.heldout_perplexity["held-out"]
    print(f"ompmoe-demo: {held_out.numel()} held-out tokens"
          f"{'' if model_name == SHIPPED_MODEL else ' (random model: perplexity means nothing)'}; "
          f"reload identical; {elapsed:.1f}s; wrote {Path(output_dir).resolve()}")
    return {"achieved_ratio": plan.achieved_ratio, "seconds": elapsed, "perplexity_before": before,
            "perplexity_after": after}


def main() -> None:
    from jsonargparse import auto_cli

    quiet_third_party()
    try:  # a bare --overwrite means --overwrite true, as on every command
        auto_cli(prune_tiny_model, description=__doc__, args=bare_flags(sys.argv[1:], ("overwrite",)))
    except user_errors() as error:
        fail(error)
    except KeyboardInterrupt:  # prune_tiny_model printed its line (none while parsing); 130 as a shell reports Ctrl-C
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
