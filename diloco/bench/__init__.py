"""Measuring: the benchmarks `diloco bench ...` runs, one module each, named after what it measures
(`codecs`, `convergence`, `overlap`, `flood`, `site`, `size`), and what they are built from: emulated
wide-area links between real processes (`wan`), a memory probe (`procmem`), line plots (`plot`) and any
run's curves (`curves`, `diloco plot`). Results and their commands: docs/BENCHMARKS.md."""
