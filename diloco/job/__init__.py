"""The bundled job: a small byte-level GPT (`model`), the Python standard library's source as its
corpus (`corpus`), and the training loop that `diloco start`, `diloco join` and `diloco demo` run
(`train`). It uses the library above it (`diloco.DiLoCo`, `diloco.Swarm`) like any user's script;
simulation, benchmarks and the command line build on it, never the other way round."""
