"""Side-by-side benchmarks of monarch_nb and Monarch; run ``python -m bench --help``."""
