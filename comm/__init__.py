"""soapstone.comm"""
