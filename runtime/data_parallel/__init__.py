"""Data parallelism: several EngineCore replicas behind one frontend, and the router that
picks a replica for each request from the replicas' published KV events and their load."""
