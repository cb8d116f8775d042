"""The start-up sweep's last part: multiprocessing semaphores that a SIGKILLed group left, which nobody
maps any more, go; one a live process maps stays (``runtime_dir.release_orphaned_semaphores``)."""

from __future__ import annotations

import mmap
import os
import secrets

from vllm_omni_plugin.processes import SHM_DIR, semaphores_of
from vllm_omni_plugin.runtime_dir import SEMAPHORE_PREFIX, release_orphaned_semaphores


def make_semaphore_file() -> str:
    name = f"{SEMAPHORE_PREFIX}test{secrets.token_hex(4)}"
    with open(os.path.join(SHM_DIR, name), "wb") as f:
        f.write(b"\0" * 32)  # a sem_t's size
    return name


def test_an_unmapped_semaphore_goes_and_a_mapped_one_stays() -> None:
    orphan, live = make_semaphore_file(), make_semaphore_file()
    try:
        with open(os.path.join(SHM_DIR, live), "r+b") as f, mmap.mmap(f.fileno(), 32):
            mapped = semaphores_of([os.getpid()])
            assert live in mapped and orphan not in mapped
            released = release_orphaned_semaphores()
            assert orphan in released and live not in released
            assert not os.path.exists(os.path.join(SHM_DIR, orphan))
            assert os.path.exists(os.path.join(SHM_DIR, live))
    finally:
        for name in (orphan, live):
            if os.path.exists(os.path.join(SHM_DIR, name)):
                os.unlink(os.path.join(SHM_DIR, name))
