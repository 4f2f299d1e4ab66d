"""Tools: plan, bench, gpu-smoke and serve. They may use stages and everything below, and
write no stage's folder."""
