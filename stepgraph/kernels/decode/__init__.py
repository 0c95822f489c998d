"""Decode attention over the paged KV cache: the ``flash_decode`` launcher, its split-KV
kernels (split + combine, or one launch with the fold), the split ladder shared by
eager, graph and exact, the launcher's inputs and the torch reference."""
