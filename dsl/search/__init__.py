"""`soapstone plan`: the search over layouts of a model on N devices."""
