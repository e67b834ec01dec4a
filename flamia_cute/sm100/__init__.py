"""The Blackwell (sm_100a, sm_103a) kernels: compiled and checked on the CPU, never run here."""
