"""hybrid2d.metrics: the one place peak memory is read."""

import torch

from hybrid2d.metrics import device_peaks, peak_memory_bytes, rss_bytes


def test_cpu_peak_is_the_process_peak_rss():
    cpu = torch.device("cpu")
    assert device_peaks(cpu) == (0, 0)
    before = peak_memory_bytes(cpu)
    big = torch.ones(96 * 2**20 // 4)  # 96 MiB, touched
    after = peak_memory_bytes(cpu)
    assert after >= rss_bytes() - 2**20  # the peak is at least what the process holds now
    assert after >= before and after >= big.numel() * 4
    del big
