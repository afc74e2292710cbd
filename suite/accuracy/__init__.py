"""The accuracy experiment (the paper's Table 3): a task a small model learns in minutes, in
MetaMathQA's question/answer format, and exact-match scoring of the final answer."""
