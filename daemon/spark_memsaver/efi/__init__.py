"""EFI variable formats, parsed strictly: efivarfs files and EFI_SIGNATURE_LISTs (efi/siglist.py, whose docstring
describes the formats), X.509 certificates (efi/x509.py) and DER headers (efi/der.py). Every name is importable
from here; every malformation raises a subclass of ``EfiFormatError``."""

from __future__ import annotations

# The formats live in efi/siglist.py (efivarfs files, signature lists, errors), efi/x509.py (certificates) and
# efi/der.py; a leaf (layer 0, was observe/efivars.py): observe/mok reads with it, decide/mok parses with it, so
# neither imports the other. Every name is importable from here (``from spark_memsaver import efi as ev``).
from spark_memsaver.efi.siglist import *  # noqa: F401,F403
from spark_memsaver.efi.siglist import _FIXED_DATA_SIZE  # noqa: F401
from spark_memsaver.efi.x509 import (Certificate, der_length_check, load_certificate,  # noqa: F401
                                     parse_certificate)
