"""The decode step: the fused step (attention, MLP, heads) and the kernel choices it
makes per bucket, the packed host rows of a decode batch, and the decode graph walks."""
