"""Recipes built on the engine: quantization after pruning, fine-tuning, plots and the quickstart demo."""
