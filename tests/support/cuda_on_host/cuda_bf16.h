// Empty: `prelude.h` defines what the CUDA codec uses of CUDA's bfloat16 header, on the host.
