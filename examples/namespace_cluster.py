"""A multi-node Ray cluster on this one machine, to try ``strata serve --executor ray`` across
nodes without having several: each node in a network namespace of its own (run as root).

    sudo python examples/namespace_cluster.py --nodes 3 --cpus-per-node 2

It prints the cluster's address and a ``strata serve`` command to run in the head's namespace,
and holds the cluster until Ctrl-C, which removes every node, namespace and link it made.
The code is ``strata.launch.bench.netns_cluster``, which the tests and ``bench.multinode`` share.
"""

from strata.launch.bench.netns_cluster import main

if __name__ == "__main__":
    main()
