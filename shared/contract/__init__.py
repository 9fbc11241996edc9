"""The contract: what crosses the wire between services. Events, commands and their
replies, projected states, subjects/streams/buckets, errors, the codec and id rules.
Imports nothing else of the product."""
