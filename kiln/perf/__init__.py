"""Performance accounting: FLOPs per token, device peaks, MFU."""
from kiln.perf.flops import device_peak_flops, flops_per_token, mfu

__all__ = ["device_peak_flops", "flops_per_token", "mfu"]
