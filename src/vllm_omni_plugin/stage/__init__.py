"""The stage runtime: core types, stage clients and processes, replica pools and the orchestrator."""
