"""Parity: same-seed metrics (PSNR, SSIM, optional LPIPS, tensor diffs) and parity reports."""
