"""EFI variable formats, parsed strictly: efivarfs files, EFI_SIGNATURE_LISTs, and the X.509 fields we report.

Pure functions over bytes; no file I/O here except :func:`read_efivarfs_file`, which only bounds a read.

* efivarfs file (``/sys/firmware/efi/efivars/<Name>-<guid>``): 4 bytes of attributes (u32, little-endian)
  followed by the variable's data (Documentation/filesystems/efivarfs.rst).
* ``EFI_SIGNATURE_LIST`` (UEFI spec 32.4.1): ``SignatureType`` (16-byte GUID) · ``SignatureListSize`` u32 ·
  ``SignatureHeaderSize`` u32 · ``SignatureSize`` u32 · header · entries of ``SignatureOwner`` GUID + data.
  A variable such as ``db`` or ``MokListRT`` is a concatenation of such lists.
* GUIDs on disk are in the UEFI "mixed-endian" layout: the first three fields little-endian, the last eight
  bytes as written (Python's ``uuid.UUID(bytes_le=...)``).

Every malformation raises a subclass of :class:`EfiFormatError` whose message names the variable, the byte
offset and what was expected; nothing here raises anything else on any input.
"""

from __future__ import annotations

# The formats live in efi/siglist.py (efivarfs files, signature lists, errors), efi/x509.py (certificates) and
# efi/der.py; a leaf (layer 0, was observe/efivars.py): observe/mok reads with it, decide/mok parses with it, so
# neither imports the other. Every name is importable from here (``from spark_memsaver import efi as ev``).
from spark_memsaver.efi.siglist import *  # noqa: F401,F403
from spark_memsaver.efi.siglist import _FIXED_DATA_SIZE  # noqa: F401
from spark_memsaver.efi.x509 import (Certificate, der_length_check, load_certificate,  # noqa: F401
                                     parse_certificate)
