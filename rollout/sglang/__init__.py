"""SGLang's contract, spoken by both sides: HTTP bodies, the launch line, the weight-update wire."""
