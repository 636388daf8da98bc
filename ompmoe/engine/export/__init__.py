"""Everything that makes a saved pruned model usable outside ompmoe: remote code, model card, tokenizer."""
