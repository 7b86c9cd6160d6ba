import sys

from saguaro.server.serve import main

sys.exit(main())
