"""Benchmarks of stacklib against the real libraries (`make bench`; not part of `make test`)."""
