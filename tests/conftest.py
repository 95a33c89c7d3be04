import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "daemon"))
sys.path.insert(0, str(REPO))  # for tests.support

os.environ.setdefault("SPARK_MEMSAVER_TEST_CACHE", "/var/cache/spark-memsaver-tests")
