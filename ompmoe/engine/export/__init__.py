"""Stage 4, export: what a run leaves behind and how it loads back: the pruned checkpoint stock tools use (weights,
config record, model card, tokenizer, remote code when a plan is not uniform) and the plots."""
