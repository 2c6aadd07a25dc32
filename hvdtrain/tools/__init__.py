"""Command-line tools that training never imports: bench, bench-data, doctor, report."""
