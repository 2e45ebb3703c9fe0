import sys

from .logits import main

sys.exit(main())
