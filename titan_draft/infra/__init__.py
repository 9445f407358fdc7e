"""Infrastructure every layer may use: errors, ranks, files, timers, metrics, process guards, torchtitan workarounds."""
