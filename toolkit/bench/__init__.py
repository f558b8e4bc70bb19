"""Benchmarks (not tests): each writes a result file with provenance under data/bench/."""
