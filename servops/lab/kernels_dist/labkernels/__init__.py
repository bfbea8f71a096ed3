"""sglang-shaped kernel namespace (sglang/kernels in 0.5.17): ops resolve their backend through a
registry whose spec imports the kernel's module on first call."""
