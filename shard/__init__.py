"""soapstone.shard"""
