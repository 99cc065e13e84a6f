"""What sinks are for: evaluations of trained models beyond validation loss (streaming perplexity with an evicting KV
cache, causal interventions on the sink), and sampling."""
