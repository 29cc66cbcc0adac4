"""Research workflows built on the engine and the provider: vector extraction from contrastive
pairs, random control vectors, coefficient sweeps and their report, linear probes, the demo."""
