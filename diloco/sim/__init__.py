"""`diloco simulate`: M workers of the bundled job in one process on the in-process transport (the real
round protocol, codecs and outer optimizer), what the run would cost on given links (`simulate`), and
the fault plans it plays out (`faults`). Built on `diloco.job`; see docs/SIMULATE.md."""
