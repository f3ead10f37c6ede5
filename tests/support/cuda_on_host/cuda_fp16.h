// Empty: `prelude.h` defines what the CUDA codec uses of CUDA's half header, on the host.
