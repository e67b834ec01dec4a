"""The Hopper (sm_90a) kernels: quantization, forward, backward and their device helpers."""
