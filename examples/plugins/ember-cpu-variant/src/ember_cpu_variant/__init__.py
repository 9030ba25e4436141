"""Example ember plugin: a "cpu_variant" platform (the CPU, with float32 attention math) and its
preferred backend. Its probe is off unless EMBER_CPU_VARIANT=1, so installing it never takes
platform selection away from the built-ins."""
