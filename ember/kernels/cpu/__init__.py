"""Native CPU kernels: C sources built on first use with the machine's C compiler (-march=native)
and called through ctypes; each has a torch fallback where no compiler is found."""
