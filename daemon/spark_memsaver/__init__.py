"""spark-memsaver: packs nvidia-uvm GPU page tables on 64 KiB-page kernels, safely."""

__version__ = "0.1.0"
