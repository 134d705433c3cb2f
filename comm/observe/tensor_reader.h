/* The contract between the rings (flight_ring.c) and the optional tensor reader
 * (tensor_reader.cpp), which hands its function over in a capsule of this name. */
#ifndef SOAP_TENSOR_READER_H
#define SOAP_TENSOR_READER_H

#define SOAP_READER_CAPSULE "soapstone.comm._tensor_reader.reader"
#define SOAP_READ_UNKNOWN (-2LL) /* not read: ask torch's getters */

/* t's dims into dims[0..maxdim) and their count into *ndim; returns t's size in bytes */
typedef long long (*soap_tensor_reader)(PyObject *t, long long *dims, int maxdim, int *ndim);

#endif
