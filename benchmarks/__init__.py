"""How tk measures its goals: the scenarios scripts/ runs (peer comparisons, goal tables), outside the package."""
