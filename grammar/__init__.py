"""soapstone.grammar"""
