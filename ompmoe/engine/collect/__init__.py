"""Stage 1, collect: one forward pass over the calibration text streams each MoE layer's sums (Gram of the expert
atoms, routing mass, token counts, energies) into statistics that merge exactly across batches, ranks and files."""
