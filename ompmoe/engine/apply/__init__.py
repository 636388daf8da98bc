"""Stage 3, apply: change the model as a plan says (prune, try candidate plans on a view, compensate the kept
experts) and switch on adaptive inference (OMP-MoE+)."""
