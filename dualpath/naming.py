"""The one name prefix that marks everything the testbed creates.

Namespaces, interfaces, bridges, nft tables and process tags all start with it,
so cleanup can find exactly what is ours and nothing else.
"""
PREFIX = "dpt"
