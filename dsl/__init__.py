"""soapstone.dsl"""
