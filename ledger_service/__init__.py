"""The lane ledger: one accounting authority for every lane's model-call budget."""
