"""``python -m kserve_adapter --model_name NAME [--model PATH | --model_dir DIR] [runtime flags]``."""
import sys

from kserve_adapter.server import main

if __name__ == "__main__":
    sys.exit(main())
