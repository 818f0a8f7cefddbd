using ExactlyOnce;
using MassTransit;
using Microsoft.EntityFrameworkCore;
using ParcelTracker.Data;
using ParcelTracker.Domain.Events;
using ParcelTracker.OutsideWorld;

namespace ParcelTracker.Consumers;

/// <summary>Reserves a carrier pickup slot and stores it on the parcel, in the inbox transaction.</summary>
[ConsumerIdentity("parcel-tracker.carrier-assignment")]
public sealed class CarrierAssignmentConsumer(ParcelDbContext db, ICarrierApiClient carrier) : IConsumer<ParcelCreatedEvent>
{
    public const string Queue = "parcel-created-carrier";

    public async Task Consume(ConsumeContext<ParcelCreatedEvent> context)
    {
        var parcel = await db.Parcels.SingleAsync(p => p.Id == context.Message.ParcelId, context.CancellationToken);
        parcel.PickupSlot = await carrier.ReservePickupSlotAsync(parcel.Id, parcel.Destination, context.CancellationToken);
        await db.SaveChangesAsync(context.CancellationToken);
    }
}
