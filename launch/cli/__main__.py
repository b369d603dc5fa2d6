import sys

from strata.launch.cli.main import main

main(sys.argv[1:])
